// What a reader of a built docs page would see wrong, as test_docs_site.py's browser test asks
// for it in each page: evaluated in the page once it has loaded; returns a plain object.
(async () => {
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  // mkdocs-material draws each diagram into a shadow root (opened by the test) after load.
  const undrawn = () => [...document.querySelectorAll(".mermaid")].filter((e) => !e.shadowRoot);
  const t0 = Date.now();
  while (undrawn().length && Date.now() - t0 < 15000) await sleep(50);
  await Promise.all([...document.images].map((i) => i.decode().catch(() => null)));
  const main = document.querySelector("article") || document.body;
  const found = {
    runOnTables: [], swallowedLists: [], headerOnlyTables: [], rawMermaid: [],
    diagrams: [], brokenImages: [], images: [], h1: main.querySelectorAll("h1").length,
  };
  // A table row or a list item that Markdown left in a paragraph: a line of its own there.
  for (const p of main.querySelectorAll("p")) {
    const lines = p.textContent.split("\n");
    lines.forEach((line, i) => {
      if (/^\s*\|.*\|\s*$/.test(line)) found.runOnTables.push(line.trim().slice(0, 100));
      else if (i > 0 && /^\s*([-*+]|\d+\.)\s/.test(line)) found.swallowedLists.push(line.trim().slice(0, 100));
    });
  }
  for (const t of main.querySelectorAll("table")) {
    if (!t.querySelector("tbody tr")) found.headerOnlyTables.push(t.textContent.trim().slice(0, 100));
  }
  for (const m of undrawn()) found.rawMermaid.push(m.textContent.trim().slice(0, 100));
  for (const m of main.querySelectorAll(".mermaid")) {
    const svg = m.shadowRoot && m.shadowRoot.querySelector("svg");
    if (!svg) continue;
    // The size the words are drawn at: their font size times the drawing's scale on the page.
    const box = svg.getBoundingClientRect();
    const view = svg.viewBox.baseVal;
    const scale = view && view.width ? box.width / view.width : 1;
    const labels = [...m.shadowRoot.querySelectorAll(".nodeLabel, .edgeLabel, text")];
    const sizes = labels
      .filter((l) => l.textContent.trim())
      .map((l) => parseFloat(getComputedStyle(l).fontSize) * scale);
    found.diagrams.push({ width: box.width, height: box.height, fontPx: Math.min(...sizes) });
  }
  for (const i of document.images) {
    const src = i.getAttribute("src");
    if (!i.complete || !i.naturalWidth) found.brokenImages.push(src);
    else found.images.push({ src, width: i.getBoundingClientRect().width });
  }
  found.mermaidBlocks = document.querySelectorAll(".mermaid").length;
  return found;
})()
