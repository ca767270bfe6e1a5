//! Fuzz tests of the routine format as proptests: whatever text arrives through
//! `POST /v1/routines` or `wor routine apply`, parsing it never panics or overflows the stack,
//! a refusal names a line inside the text, and nesting is refused past its limit by name.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use proptest::prelude::*;
use wor_core::routine::{MAX_TOML_NESTING, RoutineDefinition, RoutineError};

const VALID: &str = r#"name = "fuzz"
instructions = "Triage the inbox."

[model]
provider = "replay"
model = "script"

[[model.script.turns]]
tool_calls = [{ name = "mail__send", arguments = { to = "ops@example.com" } }]

[[model.script.turns]]
text = "done"

[budget]
turns = 5

[[tools]]
tool = "mail/send"
mode = "confirm"
pinned = { from = "support@example.com" }
"#;

/// Parses `text` on a thread with a tokio worker's default stack (2 MiB), so a recursion that
/// would abort the server fails this test instead.
fn parse_on_a_small_stack(text: String) -> Result<RoutineDefinition, RoutineError> {
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || RoutineDefinition::from_toml(&text))
        .unwrap()
        .join()
        .expect("parsing panicked or overflowed its stack")
}

/// A refusal says where: a line inside the text (or one past its end), named in the message.
fn check_refusal(text: &str, error: &RoutineError) {
    assert!(!error.message.is_empty());
    if let Some(line) = error.line {
        let lines = text.lines().count().max(1);
        assert!(
            (1..=lines + 1).contains(&line),
            "line {line} of {lines}: {error}"
        );
        assert!(
            error.message.starts_with(&format!("line {line}: ")),
            "{error}"
        );
    }
}

/// A TOML value nested `depth` levels deep, mixing arrays and inline tables as `shape` says.
fn nested_value(depth: usize, shape: &[bool]) -> String {
    let mut open = String::new();
    let mut close = String::new();
    for level in 0..depth {
        if shape
            .get(level % shape.len().max(1))
            .copied()
            .unwrap_or(true)
        {
            open.push('[');
            close.insert(0, ']');
        } else {
            open.push_str("{ k = ");
            close.insert_str(0, " }");
        }
    }
    format!("{open}1{close}")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_text_is_parsed_or_refused_with_its_line(text in "\\PC{0,400}") {
        if let Err(error) = parse_on_a_small_stack(text.clone()) {
            check_refusal(&text, &error);
        }
    }

    #[test]
    fn a_mutated_routine_is_parsed_or_refused_with_its_line(
        position in 0usize..2000,
        cut in 0usize..40,
        insert in prop_oneof![
            "\\PC{0,30}",
            Just("[[".to_owned()),
            Just("\"".to_owned()),
            Just("= [".to_owned()),
            Just("\n[[tools]]\n".to_owned()),
            Just("{ a = { b = [1, {c = 2}] } }".to_owned()),
            Just("\u{0}".to_owned()),
        ],
    ) {
        let mut chars: Vec<char> = VALID.chars().collect();
        let at = position % (chars.len() + 1);
        let end = (at + cut).min(chars.len());
        chars.splice(at..end, insert.chars());
        let text: String = chars.into_iter().collect();
        if let Err(error) = parse_on_a_small_stack(text.clone()) {
            check_refusal(&text, &error);
        }
    }

    #[test]
    fn nesting_is_accepted_to_its_limit_and_refused_past_it_by_name(
        depth in 1usize..(3 * MAX_TOML_NESTING),
        shape in proptest::collection::vec(any::<bool>(), 1..8),
    ) {
        // `pinned` is itself an inline table: one level before the value's own.
        let text = VALID.replace(
            "pinned = { from = \"support@example.com\" }",
            &format!("pinned = {{ from = {} }}", nested_value(depth, &shape)),
        );
        match parse_on_a_small_stack(text.clone()) {
            Ok(_) => prop_assert!(depth < MAX_TOML_NESTING, "{depth} levels were accepted"),
            Err(error) => {
                prop_assert!(depth >= MAX_TOML_NESTING, "{depth} levels refused: {error}");
                prop_assert!(
                    error.message.contains(&format!("nest deeper than {MAX_TOML_NESTING} levels")),
                    "{error}"
                );
                check_refusal(&text, &error);
            }
        }
    }
}

#[test]
fn the_valid_routine_parses() {
    let routine = RoutineDefinition::from_toml(VALID).unwrap();
    assert!(routine.roster_entry("mail/send").is_some());
}
