//! A bound on how deeply policy text nests, checked before the text reaches Cedar.
//!
//! Cedar's parser turns text into a tree recursively, and its validator, evaluator and `Drop`
//! walk that tree recursively: policy text nested deeply enough overflows the stack of the
//! thread that loads it (about 144 levels of `(` on a 2 MiB tokio worker in a release build,
//! about 40 unoptimised), which aborts the process. So this scan, which uses no recursion,
//! refuses such text first. It measures two things:
//!
//! - *nesting*: open `(`, `[`, `{` and `if` expressions, each of which costs Cedar's parser a
//!   chain of recursive calls; at most [`MAX_POLICY_NESTING`];
//! - *expression depth*: an upper bound on the depth of the expression tree at each point,
//!   counting every operator (`a + b + c` folds into a tree as deep as it is long, and so do
//!   `.field`, `[index]` and `.method()` chains) plus the deepest bracketed group it
//!   contains; at most [`MAX_EXPRESSION_DEPTH`].
//!
//! The lexical rules are Cedar's: white space, `//` comments to the end of the line, and
//! string literals in `"…"` in which `\` escapes the next character (a string may span lines).
//! Brackets inside strings and comments do not count. Text Cedar would refuse anyway (an
//! unclosed string, an unbalanced bracket) is left for Cedar to report.

/// The most `(`, `[`, `{` and `if` a policy may nest. Real policies nest a handful of levels.
/// Tests load and evaluate policies at this limit on a 2 MiB thread in an unoptimised build.
pub const MAX_POLICY_NESTING: usize = 32;

/// The deepest expression tree a policy may build, counted in operators along one path.
pub const MAX_EXPRESSION_DEPTH: usize = 256;

/// Which bound policy text broke, and at which byte offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DepthExcess {
    Nesting { offset: usize },
    Expression { offset: usize },
}

/// One open bracket (or the text outside every bracket).
#[derive(Debug, Default, Clone, Copy)]
struct Level {
    /// `if` expressions open at this level: each lasts until the level's `,` or its end.
    open_ifs: usize,
    /// Operators in the current item (since the last `,`): each adds at most one node to any
    /// path through the item's tree.
    operators: usize,
    /// The deepest bracketed group closed in the current item: a path enters at most one.
    deepest_group: usize,
    /// The deepest item finished at this level.
    deepest_item: usize,
}

impl Level {
    fn item_depth(&self) -> usize {
        self.operators + self.deepest_group
    }
}

/// The first place where `text` nests deeper than [`MAX_POLICY_NESTING`] or builds an
/// expression deeper than [`MAX_EXPRESSION_DEPTH`], if any.
pub(crate) fn check_depth(text: &str) -> Result<(), DepthExcess> {
    let bytes = text.as_bytes();
    let mut stack: Vec<Level> = vec![Level::default()];
    let mut at = 0;
    while let Some(&byte) = bytes.get(at) {
        let start = at;
        at += 1;
        match byte {
            b'/' if bytes.get(at) == Some(&b'/') => {
                while bytes.get(at).is_some_and(|b| *b != b'\n' && *b != b'\r') {
                    at += 1;
                }
            }
            b'"' => loop {
                match bytes.get(at) {
                    None => return Ok(()),
                    Some(b'\\') => at += 2,
                    Some(b'"') => {
                        at += 1;
                        break;
                    }
                    Some(_) => at += 1,
                }
            },
            b'(' | b'[' | b'{' => {
                // A call, an index, a set or a record is a node of the tree around it.
                if let Some(level) = stack.last_mut() {
                    level.operators += 1;
                }
                stack.push(Level::default());
                if nesting(&stack) > MAX_POLICY_NESTING {
                    return Err(DepthExcess::Nesting { offset: start });
                }
            }
            b')' | b']' | b'}' => {
                if stack.len() > 1
                    && let Some(closed) = stack.pop()
                    && let Some(parent) = stack.last_mut()
                {
                    let group = closed.deepest_item.max(closed.item_depth()) + 1;
                    parent.deepest_group = parent.deepest_group.max(group);
                    if expression_depth(&stack) > MAX_EXPRESSION_DEPTH {
                        return Err(DepthExcess::Expression { offset: start });
                    }
                }
            }
            b',' | b';' => {
                if let Some(level) = stack.last_mut() {
                    *level = Level {
                        deepest_item: level.deepest_item.max(level.item_depth()),
                        ..Level::default()
                    };
                }
            }
            b'_' | b'a'..=b'z' | b'A'..=b'Z' => {
                while bytes
                    .get(at)
                    .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
                {
                    at += 1;
                }
                let word = bytes.get(start..at).unwrap_or_default();
                let Some(level) = stack.last_mut() else {
                    continue;
                };
                match word {
                    b"if" => {
                        level.open_ifs += 1;
                        level.operators += 1;
                        if nesting(&stack) > MAX_POLICY_NESTING {
                            return Err(DepthExcess::Nesting { offset: start });
                        }
                    }
                    b"in" | b"has" | b"like" | b"is" => level.operators += 1,
                    _ => continue,
                }
                if expression_depth(&stack) > MAX_EXPRESSION_DEPTH {
                    return Err(DepthExcess::Expression { offset: start });
                }
            }
            b':' if bytes.get(at) == Some(&b':') => at += 1,
            b'&' | b'|' | b'=' | b'!' | b'<' | b'>' | b'+' | b'-' | b'*' | b'/' | b'%' | b'.' => {
                // Two-character operators count once.
                if matches!(
                    (byte, bytes.get(at)),
                    (b'&', Some(b'&'))
                        | (b'|', Some(b'|'))
                        | (b'=' | b'!' | b'<' | b'>', Some(b'='))
                ) {
                    at += 1;
                }
                if let Some(level) = stack.last_mut() {
                    level.operators += 1;
                }
                if expression_depth(&stack) > MAX_EXPRESSION_DEPTH {
                    return Err(DepthExcess::Expression { offset: start });
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Open brackets (the outermost level is not one) and open `if` expressions.
fn nesting(stack: &[Level]) -> usize {
    stack.len().saturating_sub(1) + stack.iter().map(|level| level.open_ifs).sum::<usize>()
}

/// An upper bound on the depth of the expression tree at this point: every open level adds
/// its group's node, its operators and the deepest group already closed in it.
fn expression_depth(stack: &[Level]) -> usize {
    stack.len() + stack.iter().map(Level::item_depth).sum::<usize>()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(open: &str, close: &str, levels: usize) -> String {
        format!("{}true{}", open.repeat(levels), close.repeat(levels))
    }

    #[test]
    fn brackets_count_up_to_the_limit() {
        for (open, close) in [("(", ")"), ("[", "]"), ("{a: ", "}")] {
            assert_eq!(
                check_depth(&nested(open, close, MAX_POLICY_NESTING)),
                Ok(())
            );
            let over = nested(open, close, MAX_POLICY_NESTING + 1);
            assert_eq!(
                check_depth(&over),
                Err(DepthExcess::Nesting {
                    offset: MAX_POLICY_NESTING * open.len()
                }),
                "{over}"
            );
        }
    }

    #[test]
    fn brackets_in_strings_and_comments_do_not_count() {
        let deep = "(".repeat(100);
        for text in [
            format!("\"{deep}\""),
            format!("\"a \\\" {deep}\""),
            format!("\"line\n{deep}\""),
            format!("// {deep}\ntrue"),
            format!("// {deep}\rtrue"),
            format!("@id(\"{deep}\") permit (principal, action, resource);"),
        ] {
            assert_eq!(check_depth(&text), Ok(()), "{text}");
        }
        // An escaped backslash ends the escape: the quote after it closes the string.
        let text = format!("\"\\\\\" {deep}");
        assert!(check_depth(&text).is_err(), "{text}");
        // A comment ends at the line's end.
        let text = format!("// x\n{deep}");
        assert!(check_depth(&text).is_err(), "{text}");
    }

    #[test]
    fn if_expressions_nest_until_their_bracket_or_comma_ends() {
        let chain = "if a then b else ".repeat(MAX_POLICY_NESTING - 1) + "c";
        assert_eq!(check_depth(&format!("{{ {chain} }}")), Ok(()));
        let over = format!("{{ if x then y else {chain} }}");
        assert!(
            matches!(check_depth(&over), Err(DepthExcess::Nesting { .. })),
            "{over}"
        );
        // Siblings separated by commas do not nest.
        let siblings = vec!["if a then b else c"; 100].join(", ");
        assert_eq!(check_depth(&format!("[{siblings}]")), Ok(()));
        // `if` inside an identifier is not a keyword.
        assert_eq!(check_depth(&"iffy && ".repeat(100)), Ok(()));
    }

    #[test]
    fn long_operator_chains_are_bounded() {
        let ok = "1".to_owned() + &" + 1".repeat(MAX_EXPRESSION_DEPTH - 2);
        assert_eq!(check_depth(&ok), Ok(()), "{ok}");
        for link in [" + 1", ".a", "[\"a\"]", ".contains(1)", " && true", " - 1"] {
            let text = "x".to_owned() + &link.repeat(MAX_EXPRESSION_DEPTH + 1);
            assert!(
                matches!(check_depth(&text), Err(DepthExcess::Expression { .. })),
                "{link}"
            );
        }
        // A bracketed group counts with its own depth where it is used.
        let chain = ".a".repeat(100);
        let text = format!("(((x{chain}){chain}){chain})");
        assert!(
            matches!(check_depth(&text), Err(DepthExcess::Expression { .. })),
            "{text}"
        );
        // Groups side by side, and items of a list or record, do not add up.
        let group = format!("(x{chain})");
        assert_eq!(check_depth(&vec![group; 10].join(" && ")), Ok(()));
        let items = vec!["x".to_owned() + &".a".repeat(100); 10].join(", ");
        assert_eq!(check_depth(&format!("[{items}]")), Ok(()));
    }

    #[test]
    fn entity_paths_and_unbalanced_text_are_left_to_cedar() {
        assert_eq!(
            check_depth(&"Tool::\"a/b\" == ".repeat(50).to_string()),
            Ok(())
        );
        assert_eq!(check_depth(&")".repeat(1000)), Ok(()));
        assert_eq!(check_depth("\"unclosed ((((("), Ok(()));
        assert_eq!(check_depth("\"ends in a backslash \\"), Ok(()));
    }
}
