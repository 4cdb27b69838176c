//! The book in `docs/` as the docs tests read it: its pages, their links, headings and fenced
//! code blocks, parsed with pulldown-cmark (the parser mdBook uses).

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use pulldown_cmark::{CodeBlockKind, Event, Parser, Tag, TagEnd};

/// The tags a fenced ```json block must carry after `json,`: what the example is, and so what
/// the tests do with it.
pub const JSON_TAGS: &[&str] = &[
    // A VM config: `PUT /v1/vms/{id}` must accept it.
    "vm",
    // A VM config the docs call invalid: `PUT /v1/vms/{id}` must refuse it with 400.
    "vm-refused",
    // A host spec: `vmnet apply FILE` must apply it.
    "host-spec",
    // A mesh peer set: `POST /v1/sync` of an agent with a mesh must apply it.
    "mesh-sync",
    // What the agent or the service answers (not sent): it must parse as JSON.
    "output",
];

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `docs/src`.
pub fn src() -> PathBuf {
    repo().join("docs/src")
}

/// Every markdown page under `docs/src`, by file name.
pub fn pages() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(src())
        .expect("docs/src")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect();
    out.sort();
    out
}

/// A fenced code block: its info string (`json,vm`) and text.
#[derive(Debug, Clone)]
pub struct Block {
    /// The page it is on.
    pub page: String,
    /// The info string after the fence.
    pub info: String,
    /// The block's text.
    pub text: String,
}

/// Every fenced code block of every page.
pub fn blocks() -> Vec<Block> {
    let mut out = Vec::new();
    for (page, text) in pages() {
        let mut cur: Option<Block> = None;
        for ev in Parser::new(&text) {
            match ev {
                Event::Start(Tag::CodeBlock(CodeBlockKind::Fenced(info))) => {
                    cur = Some(Block {
                        page: page.clone(),
                        info: info.to_string(),
                        text: String::new(),
                    });
                }
                Event::Text(t) => {
                    if let Some(b) = cur.as_mut() {
                        b.text.push_str(&t);
                    }
                }
                Event::End(TagEnd::CodeBlock) => out.extend(cur.take()),
                _ => {}
            }
        }
    }
    out
}

/// The JSON blocks with tag `tag` (`json,<tag>`).
pub fn json_blocks(tag: &str) -> Vec<Block> {
    blocks()
        .into_iter()
        .filter(|b| b.info.split(',').map(str::trim).eq(["json", tag]))
        .collect()
}

/// The link destinations of a markdown text.
pub fn links(text: &str) -> Vec<String> {
    Parser::new(text)
        .filter_map(|ev| match ev {
            Event::Start(Tag::Link { dest_url, .. }) => Some(dest_url.to_string()),
            _ => None,
        })
        .collect()
}

/// The anchors mdBook gives a page's headings: the heading text lower-cased, spaces turned
/// into `-`, every other character that is not alphanumeric, `-` or `_` dropped; a repeated
/// anchor gets `-1`, `-2`, ….
pub fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut heading: Option<String> = None;
    for ev in Parser::new(text) {
        match ev {
            Event::Start(Tag::Heading { .. }) => {
                heading = Some(String::new());
            }
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                if let Some(h) = heading.take() {
                    let base = slug(&h);
                    let mut id = base.clone();
                    let mut n = 1;
                    while out.contains(&id) {
                        id = format!("{base}-{n}");
                        n += 1;
                    }
                    out.insert(id);
                }
            }
            _ => {}
        }
    }
    out
}

fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}
