"""Checks the built documentation site in a real headless browser.

    python tools/check_site.py [site]      # default: site/ (mkdocs build -d site)

Serves the built site on 127.0.0.1 under a sub-path (`/keras_fastgrad/`,
as a project site is served; a missing path gets `404.html` with status
404, as static hosts do) and opens every page in Chromium (Debian's
`chromium`, driven by playwright; no browser download). It fails when

- a page, or anything it loads (CSS, scripts, fonts, images), is missing,
  or the page asks for anything off this machine (the site must work
  offline), or a script on it throws;
- a formula is left unrendered: every `.arithmatex` element (the formulas
  of the Markdown pages) must hold KaTeX's output, and no raw `\\(` or
  `\\[` may be left in the page's text outside code;
- a notebook page shows no outputs (cells run, their printed text and
  plots: `.jp-OutputArea-output`);
- an internal link leads nowhere: every `<a href>` into the site must load
  (status 200) and its `#fragment`, if any, must be an `id` on the target
  page; a link that leaves the site's sub-path (a link written for a
  domain's root) fails too. The 404 page is checked the same way, shown at
  a missing address two folders deep.

Without Chromium (or playwright) it says so and exits 0, unless `CI` is
set (`CI=true`, as `.ci/run` runs): then it fails. Exit status 1 on any
problem, each printed with the page it was found on.
"""

import argparse
import functools
import http.server
import os
import shutil
import sys
import threading
from urllib.parse import urldefrag, urljoin, urlsplit

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PREFIX = "/keras_fastgrad/"
MISSING = PREFIX + "no/such/page/"


class SiteHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the site under `PREFIX`; 404.html (status 404) when missing."""

    def translate_path(self, path):
        path = urlsplit(path).path
        if not path.startswith(PREFIX):
            return os.path.join(self.directory, "..", "outside-the-site-path", "missing")
        return super().translate_path("/" + path[len(PREFIX) :])

    def send_error(self, code, message=None, explain=None):
        page = os.path.join(self.directory, "404.html")
        if code != 404 or not os.path.exists(page):
            return super().send_error(code, message, explain)
        with open(page, "rb") as f:
            body = f.read()
        self.send_response(404)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, *args):
        pass


def site_pages(site):
    """Site-relative URLs of every page (`index.html` -> its folder)."""
    pages = []
    for folder, _, names in os.walk(site):
        for name in names:
            if name.endswith(".html") and name != "404.html":
                path = os.path.relpath(os.path.join(folder, name), site).replace(os.sep, "/")
                pages.append(path[: -len("index.html")] if path.endswith("index.html") else path)
    return sorted(pages)


READ_PAGE = """() => {
  const text = (root) => {
    const copy = root.cloneNode(true);
    copy.querySelectorAll("pre, code, script, style, .katex").forEach((e) => e.remove());
    return copy.textContent;
  };
  const content = document.querySelector("article") || document.body;
  return {
    ids: [...document.querySelectorAll("[id]")].map((e) => e.id)
      .concat([...document.querySelectorAll("a[name]")].map((e) => e.name)),
    links: [...document.querySelectorAll("a[href]")].map((a) => a.href),
    formulas: document.querySelectorAll(".arithmatex").length,
    unrendered: [...document.querySelectorAll(".arithmatex")]
      .filter((e) => !e.querySelector(".katex")).map((e) => e.textContent.slice(0, 60)),
    katex: document.querySelectorAll(".katex").length,
    rawTex: (text(content).match(/\\\\[(\\[][^]{0,50}/g) || []),
    outputs: document.querySelectorAll(".jp-OutputArea-output").length,
    notebook: document.querySelectorAll(".jupyter-wrapper").length > 0,
  };
}"""


def check(site, browser, base):
    problems, seen = [], {}
    origin = "{0.scheme}://{0.netloc}".format(urlsplit(base))

    def visit(url, expect_status=200):
        """Loads `url`; returns what READ_PAGE reads, and records problems."""
        page = browser.new_page()
        found = []
        page.on("pageerror", lambda error: found.append(f"script error: {error}"))

        def route(r):
            if r.request.url.startswith(origin):
                r.continue_()
            else:
                found.append(f"asks for {r.request.url} (off this machine)")
                r.abort()

        page.route("**/*", route)
        page.on(
            "response",
            lambda response: (
                response.status >= 400
                and response.url != url
                and response.request.method != "HEAD"  # 404.html looking for the root
                and found.append(f"{response.url}: status {response.status}")
            ),
        )
        response = page.goto(url, wait_until="load")
        page.wait_for_timeout(100)  # Material's and KaTeX's scripts run on load
        status = response.status if response else None
        if status != expect_status:
            found.append(f"status {status}, expected {expect_status}")
        info = page.evaluate(READ_PAGE) if status in (200, 404) else None
        page.close()
        for problem in found:
            problems.append(f"{url}: {problem}")
        return info

    infos = {}

    def load(url, expect_status=200):
        if url not in infos:
            infos[url] = visit(url, expect_status)
        return infos[url]

    def target(url):
        """(status, ids) of a link's target; each page is loaded once."""
        if url not in seen:
            path = urlsplit(url).path
            if path.endswith("/") or path.endswith(".html"):
                info = load(url)
                seen[url] = (200, set(info["ids"])) if info else (None, set())
            else:
                relative = path[len(PREFIX) :]
                exists = path.startswith(PREFIX) and os.path.isfile(os.path.join(site, relative))
                seen[url] = (200 if exists else 404, set())
        return seen[url]

    pages = [(urljoin(base, p), 200) for p in site_pages(site)]
    pages.append((urljoin(base, MISSING[len(PREFIX) :]), 404))
    counts = {"pages": 0, "links": 0, "anchors": 0, "formulas": 0, "notebooks": 0}
    for url, expect in pages:
        info = load(url, expect)
        if info is None:
            continue
        counts["pages"] += 1
        counts["formulas"] += info["formulas"]
        if info["unrendered"]:
            problems.append(f"{url}: formulas not rendered: {info['unrendered'][:3]}")
        if info["rawTex"]:
            problems.append(f"{url}: raw TeX left in the text: {info['rawTex'][:3]}")
        if info["notebook"]:
            counts["notebooks"] += 1
            if not info["outputs"]:
                problems.append(f"{url}: a notebook page without outputs")
        for link in info["links"]:
            if not link.startswith(origin):
                continue  # outside links: not followed (no network)
            counts["links"] += 1
            address, fragment = urldefrag(link)
            if not urlsplit(address).path.startswith(PREFIX):
                problems.append(f"{url}: links out of the site's path: {link}")
                continue
            status, ids = target(address)
            if status != 200:
                problems.append(f"{url}: broken link {link} (status {status})")
            elif fragment and urlsplit(address).path.endswith(("/", ".html")):
                counts["anchors"] += 1
                if fragment not in ids:
                    problems.append(f"{url}: broken anchor {link}")
    return problems, counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", nargs="?", default="site", help="the built site (mkdocs build -d)")
    args = parser.parse_args(argv)
    in_ci = os.environ.get("CI", "").lower() not in ("", "0", "false")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    missing = []
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        missing.append(f"Chromium ({CHROMIUM}; Debian: apt-get install -y chromium)")
    if sync_playwright is None:
        missing.append("playwright (pip install -c constraints.txt -e '.[docs]')")
    if missing:
        message = f"check_site: needs {' and '.join(missing)}"
        if in_ci:
            print(f"{message}. CI is set: failing.", file=sys.stderr)
            return 1
        print(f"{message}: the browser check is SKIPPED.")
        return 0
    site = os.path.abspath(args.site)
    if not os.path.exists(os.path.join(site, "index.html")):
        print(f"check_site: no built site in {site} (run mkdocs build -d site)", file=sys.stderr)
        return 1
    handler = functools.partial(SiteHandler, directory=site)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}{PREFIX}"
    executable = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
            try:
                problems, counts = check(site, browser, base)
            finally:
                browser.close()
    finally:
        server.shutdown()
    summary = ", ".join(f"{n} {what}" for what, n in counts.items())
    if problems:
        print("\n".join(problems), file=sys.stderr)
        print(f"check_site: {len(problems)} problems ({summary})", file=sys.stderr)
        return 1
    print(f"check_site: the site renders and every internal link resolves ({summary})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
