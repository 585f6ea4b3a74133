// The chat page's Markdown: marked (vendored), made safe for a model's text. Raw HTML is shown as text, links
// only to http(s) and mailto (others: their text), images as their alt text (nothing is fetched).
"use strict";
const renderMarkdown = (() => {
  const escapeHtml = (s) => String(s).replace(/[&<>"']/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  const md = new marked.Marked({
    gfm: true, breaks: true, async: false,
    renderer: {
      html(token) { return escapeHtml(token.text); },
      link({ href, tokens }) {
        const text = this.parser.parseInline(tokens);
        return /^(https?:|mailto:)/i.test(href)
          ? `<a href="${escapeHtml(href)}" rel="noopener noreferrer" target="_blank">${text}</a>` : text;
      },
      image({ href, text }) { return escapeHtml(text || href); },
    },
  });
  return (text) => md.parse(text);
})();
