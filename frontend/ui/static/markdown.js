// Markdown to DOM nodes, safely: every piece of the model's text becomes a text node
// (textContent), never HTML, so a reply containing <script> or <img onerror> shows as text.
// Covers what chat answers use: fenced code, headings, lists, quotes, paragraphs, and inline
// code, bold, italic and http(s) links.

const FENCE = /^\s*```\s*([\w+-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;
const QUOTE = /^>\s?(.*)$/;
// Inline: `code`, **bold**, *italic* / _italic_, [text](http...).
const INLINE = /(`[^`]+`)|(\*\*[^*]+\*\*)|(\*[^*\s][^*]*\*|_[^_\s][^_]*_)|(\[[^\]]+\]\(https?:\/\/[^\s)]+\))/;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

export function renderInline(text, parent) {
  let rest = text;
  while (rest) {
    const m = INLINE.exec(rest);
    if (!m) {
      parent.append(document.createTextNode(rest));
      return;
    }
    if (m.index > 0) parent.append(document.createTextNode(rest.slice(0, m.index)));
    const token = m[0];
    if (m[1]) {
      const code = el("code");
      code.textContent = token.slice(1, -1);
      parent.append(code);
    } else if (m[2]) {
      const strong = el("strong");
      renderInline(token.slice(2, -2), strong);
      parent.append(strong);
    } else if (m[3]) {
      const em = el("em");
      renderInline(token.slice(1, -1), em);
      parent.append(em);
    } else {
      const close = token.indexOf("](");
      const link = el("a");
      link.href = token.slice(close + 2, -1);  // http(s) only: the pattern allows nothing else
      link.rel = "noopener noreferrer nofollow";
      link.target = "_blank";
      link.textContent = token.slice(1, close);
      parent.append(link);
    }
    rest = rest.slice(m.index + token.length);
  }
}

function flushParagraph(lines, out) {
  if (!lines.length) return;
  const p = el("p");
  lines.forEach((line, i) => {
    if (i) p.append(el("br"));
    renderInline(line, p);
  });
  out.append(p);
  lines.length = 0;
}

// A DocumentFragment of `text` rendered; an unclosed fence (still streaming) is a code block.
export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  const paragraph = [];
  let list = null;
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      flushParagraph(paragraph, out);
      list = null;
      const body = [];
      for (i++; i < lines.length && !FENCE.test(lines[i]); i++) body.push(lines[i]);
      const pre = el("pre");
      const code = el("code", fence[1] ? `language-${fence[1]}` : "");
      code.textContent = body.join("\n");
      pre.append(code);
      out.append(pre);
      continue;
    }
    const heading = HEADING.exec(line);
    const bullet = BULLET.exec(line);
    const numbered = bullet ? null : NUMBERED.exec(line);
    const quote = QUOTE.exec(line);
    if (heading) {
      flushParagraph(paragraph, out);
      list = null;
      const h = el(`h${Math.min(heading[1].length + 2, 6)}`);
      renderInline(heading[2], h);
      out.append(h);
    } else if (bullet || numbered) {
      flushParagraph(paragraph, out);
      const tag = bullet ? "ul" : "ol";
      if (!list || list.tagName.toLowerCase() !== tag) {
        list = el(tag);
        out.append(list);
      }
      const item = el("li");
      renderInline((bullet || numbered)[1], item);
      list.append(item);
    } else if (quote) {
      flushParagraph(paragraph, out);
      list = null;
      const q = el("blockquote");
      renderInline(quote[1], q);
      out.append(q);
    } else if (!line.trim()) {
      flushParagraph(paragraph, out);
      list = null;
    } else {
      list = null;
      paragraph.push(line);
    }
  }
  flushParagraph(paragraph, out);
  return out;
}
