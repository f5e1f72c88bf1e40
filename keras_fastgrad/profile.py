"""`python -m keras_fastgrad.profile`: the step profiler's command line,
kept under its first name (now `python -m keras_fastgrad.profiling`)."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("keras_fastgrad.profiling", run_name="__main__", alter_sys=True)
