// Renders the formulas that pymdownx.arithmatex (generic mode) wraps in
// `<span class="arithmatex">\(...\)</span>` / `<div class="arithmatex">\[...\]</div>`,
// and the `$$...$$` of notebook cells, with the KaTeX vendored in
// docs/assets/katex/ (the site needs no network).
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "$$", right: "$$", display: true },
      { left: "\\[", right: "\\]", display: true },
      { left: "\\(", right: "\\)", display: false },
    ],
    throwOnError: false,
  });
});
