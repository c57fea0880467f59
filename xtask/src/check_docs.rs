//! `cargo xtask check-docs`: the facade's rendered docs (`target/doc/tensorplay/`, made by
//! `cargo doc --workspace --no-deps`) must be pasteable by a user who depends on `tensorplay`
//! only: no example code block names an internal crate (`tensorplay_core`, ...), and no prose
//! shows a literal `[tensorplay_...` (an intra-doc link that did not resolve from the facade).

use std::fs;
use std::path::{Path, PathBuf};

/// The crates behind the facade, which a user of `tensorplay` cannot name.
const INTERNAL_CRATES: &[&str] = &[
    "tensorplay_core",
    "tensorplay_collectives",
    "tensorplay_rpc",
    "tensorplay_distributed_nn",
    "tensorplay_macros",
    "tensorplay_conformance",
];

/// What rendered prose shows when an intra-doc link to an internal crate did not resolve.
const BROKEN_LINK: &str = "[tensorplay_";

/// One rendered code block: `<pre class="rust ...">`.
#[derive(Debug, PartialEq)]
struct Block {
    /// An item's declaration (`<pre class="rust item-decl">`) rather than a doc example.
    decl: bool,
    /// The code, tags stripped and entities decoded.
    code: String,
}

/// One rendered page, split into its code blocks and its prose.
#[derive(Debug, Default)]
struct Page {
    /// Every `<pre class="rust ...">` block: the doc examples and the items' declarations.
    blocks: Vec<Block>,
    /// Everything outside those blocks, tags stripped and entities decoded.
    prose: String,
}

/// The rendered facade docs: `$CARGO_TARGET_DIR/doc/tensorplay`, else the workspace's
/// `target/doc/tensorplay`.
fn doc_dir() -> PathBuf {
    let target = crate::process::target_dir();
    target.join("doc").join("tensorplay")
}

/// Runs the check over the rendered facade docs; prints each problem and a summary line.
pub(crate) fn check_docs() -> Result<(), String> {
    let dir = doc_dir();
    if !dir.is_dir() {
        return Err(format!(
            "{} not found: run `cargo doc --workspace --no-deps` first",
            dir.display()
        ));
    }
    let mut files = Vec::new();
    collect_html(&dir, &mut files)?;
    files.sort();
    let mut examples = 0;
    let mut problems = 0;
    for file in &files {
        let html = fs::read_to_string(file)
            .map_err(|e| format!("could not read {}: {e}", file.display()))?;
        let page = extract(&html);
        examples += page.blocks.iter().filter(|b| !b.decl).count();
        let shown = file.strip_prefix(&dir).unwrap_or(file);
        for p in page_problems(&page) {
            println!("tensorplay/{}: {p}", shown.display());
            problems += 1;
        }
    }
    println!(
        "check-docs: {} pages, {examples} examples, {problems} problems",
        files.len()
    );
    if files.is_empty() {
        return Err(format!(
            "no HTML pages under {}: run `cargo doc --workspace --no-deps` first",
            dir.display()
        ));
    }
    if problems == 0 {
        Ok(())
    } else {
        Err(format!(
            "{problems} problems in the facade docs: examples must use `tensorplay` paths \
             (`use tensorplay as tp;`), and prose links must resolve from the facade"
        ))
    }
}

/// Every `.html` file under `dir`, recursively.
fn collect_html(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let entries =
        fs::read_dir(dir).map_err(|e| format!("could not list {}: {e}", dir.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("could not list {}: {e}", dir.display()))?;
        let path = entry.path();
        if path.is_dir() {
            collect_html(&path, out)?;
        } else if path.extension().is_some_and(|x| x == "html") {
            out.push(path);
        }
    }
    Ok(())
}

/// Splits a page into its `<pre class="rust ...">` blocks and the prose around them.
fn extract(html: &str) -> Page {
    const OPEN: &str = "<pre class=\"rust";
    const CLOSE: &str = "</pre>";
    let mut page = Page::default();
    let mut prose_html = String::new();
    let mut rest = html;
    while let Some(start) = rest.find(OPEN) {
        prose_html.push_str(&rest[..start]);
        let block = &rest[start..];
        let Some(tag_end) = block.find('>') else {
            rest = "";
            break;
        };
        let class = block[OPEN.len()..tag_end].split('"').next().unwrap_or("");
        let body = &block[tag_end + 1..];
        let (code, after) = match body.find(CLOSE) {
            Some(end) => (&body[..end], &body[end + CLOSE.len()..]),
            None => (body, ""),
        };
        page.blocks.push(Block {
            decl: class.split_whitespace().any(|c| c == "item-decl"),
            code: decode_entities(&strip_tags(code)),
        });
        rest = after;
    }
    prose_html.push_str(rest);
    page.prose = decode_entities(&strip_tags(&prose_html));
    page
}

/// `html` without its tags (`<...>`); `<script>` and `<style>` contents are kept as text,
/// which holds no `[tensorplay_` in rustdoc's output.
fn strip_tags(html: &str) -> String {
    let mut out = String::with_capacity(html.len());
    let mut in_tag = false;
    for c in html.chars() {
        match (in_tag, c) {
            (false, '<') => in_tag = true,
            (false, _) => out.push(c),
            (true, '>') => in_tag = false,
            (true, _) => {}
        }
    }
    out
}

/// Decodes `&lt; &gt; &amp; &quot; &#39;` (and other numeric references) in one pass.
fn decode_entities(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(amp) = rest.find('&') {
        out.push_str(&rest[..amp]);
        let tail = &rest[amp..];
        let decoded = tail.find(';').filter(|&semi| semi <= 10).and_then(|semi| {
            let name = &tail[1..semi];
            let c = match name {
                "lt" => Some('<'),
                "gt" => Some('>'),
                "amp" => Some('&'),
                "quot" => Some('"'),
                "apos" => Some('\''),
                "nbsp" => Some('\u{a0}'),
                _ => name
                    .strip_prefix("#x")
                    .or_else(|| name.strip_prefix("#X"))
                    .and_then(|hex| u32::from_str_radix(hex, 16).ok())
                    .or_else(|| name.strip_prefix('#').and_then(|d| d.parse().ok()))
                    .and_then(char::from_u32),
            };
            c.map(|c| (c, semi + 1))
        });
        match decoded {
            Some((c, len)) => {
                out.push(c);
                rest = &tail[len..];
            }
            None => {
                out.push('&');
                rest = &tail[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The problems of one page: each line of an example (or declaration) naming an internal
/// crate, and each literal `[tensorplay_` in the prose (with some context).
fn page_problems(page: &Page) -> Vec<String> {
    let mut out = Vec::new();
    let mut example = 0;
    for block in &page.blocks {
        let what = if block.decl {
            "declaration".to_string()
        } else {
            example += 1;
            format!("example {example}")
        };
        for line in block.code.lines() {
            if let Some(name) = INTERNAL_CRATES.iter().find(|n| line.contains(**n)) {
                out.push(format!("{what} names `{name}`: {}", line.trim()));
            }
        }
    }
    let prose = &page.prose;
    let mut from = 0;
    while let Some(at) = prose[from..].find(BROKEN_LINK) {
        let at = from + at;
        let before = floor_char_boundary(prose, at.saturating_sub(60));
        let after = floor_char_boundary(prose, (at + 60).min(prose.len()));
        let context = prose[before..after]
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        out.push(format!(
            "broken link `{BROKEN_LINK}` in prose: ...{context}..."
        ));
        from = at + BROKEN_LINK.len();
    }
    out
}

/// The largest char boundary of `s` at or below `i`.
fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = r#"<html><body><main>
<pre class="rust item-decl"><code>pub fn add(a: &amp;<a href="struct.Tensor.html">Tensor</a>) -&gt; Tensor</code></pre>
<div class="docblock"><p>Adds things; see [<code>tensorplay_rpc</code>] for more.</p>
<div class="example-wrap"><pre class="rust rust-example-rendered"><code><span class="kw">use </span>tensorplay_core::Tensor;
<span class="kw">let </span>v: Vec&lt;f32&gt; = <span class="macro">vec!</span>[<span class="number">1.</span>];
<span class="boring">Ok::&lt;(), tensorplay_core::Error&gt;(())
</span></code></pre></div>
<p>A good one &amp; fine:</p>
<div class="example-wrap"><pre class="rust rust-example-rendered"><code><span class="kw">use </span>tensorplay <span class="kw">as </span>tp;
<span class="kw">let </span>s = <span class="string">&quot;it&#39;s&quot;</span>;</code></pre></div>
</div></main></body></html>"#;

    #[test]
    fn extracts_examples_and_prose() {
        let page = extract(PAGE);
        assert_eq!(page.blocks.len(), 3);
        assert_eq!(
            page.blocks[0],
            Block {
                decl: true,
                code: "pub fn add(a: &Tensor) -> Tensor".into()
            }
        );
        assert_eq!(
            page.blocks[1],
            Block {
                decl: false,
                code: "use tensorplay_core::Tensor;\nlet v: Vec<f32> = vec![1.];\n\
                       Ok::<(), tensorplay_core::Error>(())\n"
                    .into()
            }
        );
        assert_eq!(
            page.blocks[2],
            Block {
                decl: false,
                code: "use tensorplay as tp;\nlet s = \"it's\";".into()
            }
        );
        assert!(page.prose.contains("see [tensorplay_rpc] for more."));
        assert!(page.prose.contains("A good one & fine:"));
        assert!(!page.prose.contains("use tensorplay"));
    }

    #[test]
    fn flags_the_bad_example_lines_and_the_broken_link_only() {
        let problems = page_problems(&extract(PAGE));
        assert_eq!(problems.len(), 3, "{problems:#?}");
        assert!(problems[0].contains("example 1") && problems[0].contains("use tensorplay_core"));
        assert!(problems[1].contains("tensorplay_core::Error"));
        assert!(problems[2].starts_with("broken link") && problems[2].contains("[tensorplay_rpc]"));
    }

    #[test]
    fn a_clean_page_has_no_problems() {
        let page = extract(
            "<p>See <a href=\"../tensorplay_rpc/index.html\">rpc</a>.</p>\
             <pre class=\"rust\"><code>use tensorplay as tp;\nlet _ = tp::ones(&amp;[2]);</code></pre>",
        );
        assert_eq!(
            page.blocks,
            [Block {
                decl: false,
                code: "use tensorplay as tp;\nlet _ = tp::ones(&[2]);".into()
            }]
        );
        assert!(page_problems(&page).is_empty());
    }

    #[test]
    fn decodes_entities_once() {
        assert_eq!(
            decode_entities("&amp;lt; &lt;&gt; &#x27;a&#39; & b"),
            "&lt; <> 'a' & b"
        );
    }
}
