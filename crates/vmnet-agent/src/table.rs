//! The one text table renderer for everything vmnet prints as a table: the CLI's lists, the
//! sandbox's reports and the benchmarks.
//!
//! A table is a header and rows of cells; columns are as wide as their widest cell (counted in
//! characters) and separated by two spaces; a dashed rule follows the header. Cells come from
//! user input (ids, error messages), so control characters are shown escaped (`\u{1b}`), never
//! sent to the terminal. Trailing spaces are trimmed from every line.

use std::fmt::Write as _;

/// How a column's cells line up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Align {
    /// Text: padded on the right (the default).
    #[default]
    Left,
    /// Numbers: padded on the left.
    Right,
}

/// `s` with control characters escaped, the rest as is.
fn printable(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Renders `rows` under `header`, every column left-aligned (see the module docs).
#[must_use]
pub fn render(header: &[&str], rows: &[Vec<String>]) -> String {
    render_aligned(header, &[], rows)
}

/// Renders `rows` under `header`; `align[i]` lines up column `i` (columns beyond `align` are
/// left-aligned).
#[must_use]
pub fn render_aligned(header: &[&str], align: &[Align], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| printable(c)).collect())
        .collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (i, cell) in row.iter().enumerate() {
            let n = cell.chars().count();
            match widths.get_mut(i) {
                Some(w) => *w = (*w).max(n),
                None => widths.push(n),
            }
        }
    }
    let mut out = String::new();
    let mut line = |cells: &[&str]| {
        let parts: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(
                |(i, (c, w))| match align.get(i).copied().unwrap_or_default() {
                    Align::Left => format!("{c:<w$}"),
                    Align::Right => format!("{c:>w$}"),
                },
            )
            .collect();
        let _ = writeln!(out, "{}", parts.join("  ").trim_end());
    };
    line(header);
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    line(&rule.iter().map(String::as_str).collect::<Vec<_>>());
    for row in &rows {
        line(&row.iter().map(String::as_str).collect::<Vec<_>>());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_and_a_rule_follows_the_header() {
        let t = render(
            &["ID", "STATE"],
            &[
                vec!["web-1".into(), "applied".into()],
                vec!["x".into(), "-".into()],
            ],
        );
        assert_eq!(
            t,
            "ID     STATE\n-----  -------\nweb-1  applied\nx      -\n"
        );
    }

    #[test]
    fn right_aligned_numbers() {
        let t = render_aligned(
            &["N", "MS"],
            &[Align::Right, Align::Right],
            &[vec!["1000".into(), "3.01".into()]],
        );
        assert_eq!(t, "   N    MS\n----  ----\n1000  3.01\n");
    }

    #[test]
    fn control_characters_are_escaped() {
        let t = render(&["ID"], &[vec!["\u{1b}[2Jweb\n".into()]]);
        assert!(!t.contains('\u{1b}'), "{t:?}");
        assert!(t.contains("\\u{1b}[2Jweb\\n"), "{t:?}");
    }

    #[test]
    fn a_row_wider_than_the_header_keeps_its_cells() {
        let t = render(&["A"], &[vec!["x".into(), "extra".into()]]);
        assert_eq!(t, "A\n-  -----\nx  extra\n");
    }
}
