// A small, safe Markdown renderer for the chat page (docs/chat-page.md §3).
// Safety first: the whole source is HTML-escaped before any parsing, so every tag in
// the output is one this file writes; links keep only http(s) and mailto targets.
// Covers what models write: fenced code, inline code, headings, lists, quotes, rules,
// pipe tables, bold / italic / strike, links.  An unclosed fence (a streaming answer)
// renders as code up to the end.
'use strict';

(function (global) {
  const ESC = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };

  function escapeHtml(text) {
    return String(text).replace(/[&<>"']/g, (c) => ESC[c]);
  }

  // --- inline -------------------------------------------------------------------------
  // Constructs become numbered placeholders (\u0000N\u0000) so later rules never see
  // their output; the escaped source cannot contain \u0000 (it is stripped first).
  function inline(src) {
    const held = [];
    const hold = (html) => '\u0000' + (held.push(html) - 1) + '\u0000';
    let s = src;
    s = s.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) => hold('<code>' + code.trim() + '</code>'));
    s = s.replace(/\[([^\]\n]+)\]\(\s*((?:https?:\/\/|mailto:)[^\s()]+)\s*\)/gi, (_, label, url) =>
      hold('<a href="' + url + '" target="_blank" rel="noopener noreferrer">' + emphasis(label) + '</a>'),
    );
    s = s.replace(/(^|[\s(])(https?:\/\/[^\s<()]*[^\s<().,;:!?'&])/gi, (_, pre, url) =>
      pre + hold('<a href="' + url + '" target="_blank" rel="noopener noreferrer">' + url + '</a>'),
    );
    s = emphasis(s);
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => held[Number(i)]);
  }

  function emphasis(s) {
    return s
      .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, '<strong>$1</strong>')
      .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, '$1<strong>$2</strong>')
      .replace(/(^|[^*\w])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?!\*)/g, '$1<em>$2</em>')
      .replace(/(^|[^\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?!\w)/g, '$1<em>$2</em>')
      .replace(/~~(?=\S)([\s\S]*?\S)~~/g, '<del>$1</del>');
  }

  // --- blocks -------------------------------------------------------------------------
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}&gt;\s?/;
  const BULLET = /^\s*[-*+]\s+/;
  const NUMBERED = /^\s*(\d{1,9})[.)]\s+/;
  const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  function cells(line) {
    let s = line.trim();
    if (s.startsWith('|')) s = s.slice(1);
    if (s.endsWith('|')) s = s.slice(0, -1);
    return s.split('|').map((c) => c.trim());
  }

  function isBlockStart(line, next) {
    return (
      FENCE.test(line) ||
      HEADING.test(line) ||
      RULE.test(line) ||
      QUOTE.test(line) ||
      BULLET.test(line) ||
      NUMBERED.test(line) ||
      (line.includes('|') && next !== undefined && TABLE_RULE.test(next) && next.includes('-'))
    );
  }

  function blocks(lines) {
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) {
        i++;
        continue;
      }
      let m = FENCE.exec(line);
      if (m) {
        const close = new RegExp('^ {0,3}' + m[1][0] + '{' + m[1].length + ',}\\s*$');
        const body = [];
        i++;
        while (i < lines.length && !close.test(lines[i])) body.push(lines[i++]);
        i++; // the closing fence (or the end)
        const lang = m[2];
        out.push(
          '<div class="code"><div class="code-head"><span>' +
            (lang || 'code') +
            '</span><button type="button" class="copy-code">Copy</button></div><pre><code' +
            (lang ? ' class="language-' + lang + '"' : '') +
            '>' +
            body.join('\n') +
            '</code></pre></div>',
        );
        continue;
      }
      if ((m = HEADING.exec(line))) {
        const n = m[1].length;
        out.push('<h' + n + '>' + inline(m[2]) + '</h' + n + '>');
        i++;
        continue;
      }
      if (RULE.test(line)) {
        out.push('<hr>');
        i++;
        continue;
      }
      if (QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && QUOTE.test(lines[i])) body.push(lines[i++].replace(QUOTE, ''));
        out.push('<blockquote>' + blocks(body) + '</blockquote>');
        continue;
      }
      if (BULLET.test(line) || NUMBERED.test(line)) {
        const ordered = !BULLET.test(line);
        const marker = ordered ? NUMBERED : BULLET;
        const start = ordered ? Number(NUMBERED.exec(line)[1]) : 1;
        const items = [];
        while (i < lines.length) {
          const l = lines[i];
          if (marker.test(l)) items.push([l.replace(marker, '')]);
          else if (l.trim() && /^\s{2,}/.test(l) && items.length) items[items.length - 1].push(l.trim());
          else break;
          i++;
        }
        const tag = ordered ? 'ol' : 'ul';
        out.push(
          '<' +
            tag +
            (ordered && start !== 1 ? ' start="' + start + '"' : '') +
            '>' +
            items.map((it) => '<li>' + inline(it.join('\n')).replace(/\n/g, '<br>') + '</li>').join('') +
            '</' +
            tag +
            '>',
        );
        continue;
      }
      if (line.includes('|') && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes('-')) {
        const head = cells(line);
        const aligns = cells(lines[i + 1]).map((c) =>
          c.startsWith(':') && c.endsWith(':') ? 'center' : c.endsWith(':') ? 'right' : c.startsWith(':') ? 'left' : '',
        );
        const cell = (tag, text, k) =>
          '<' + tag + (aligns[k] ? ' class="align-' + aligns[k] + '"' : '') + '>' + inline(text) + '</' + tag + '>';
        i += 2;
        const rows = [];
        while (i < lines.length && lines[i].includes('|') && lines[i].trim()) rows.push(cells(lines[i++]));
        out.push(
          '<div class="table"><table><thead><tr>' +
            head.map((c, k) => cell('th', c, k)).join('') +
            '</tr></thead><tbody>' +
            rows.map((r) => '<tr>' + head.map((_, k) => cell('td', r[k] || '', k)).join('') + '</tr>').join('') +
            '</tbody></table></div>',
        );
        continue;
      }
      const para = [];
      while (i < lines.length && lines[i].trim() && !(para.length && isBlockStart(lines[i], lines[i + 1]))) {
        para.push(lines[i++]);
      }
      out.push('<p>' + inline(para.join('\n')).replace(/\n/g, '<br>') + '</p>');
    }
    return out.join('');
  }

  function render(text) {
    const safe = escapeHtml(String(text).replace(/\u0000/g, '').replace(/\r\n?/g, '\n'));
    return blocks(safe.split('\n'));
  }

  global.ds4md = { render, escapeHtml };
})(window);
