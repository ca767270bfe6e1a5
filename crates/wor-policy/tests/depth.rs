//! Policy text nested to the limit loads and decides on a 2 MiB thread (a tokio worker's
//! stack) in this unoptimised build; one level more is refused with an error naming the limit
//! and the line, before Cedar's recursive parser sees it. Random nesting never overflows.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use proptest::prelude::*;
use wor_core::call::{ToolClass, Verdict};
use wor_policy::{
    DecisionRequest, MAX_EXPRESSION_DEPTH, MAX_POLICY_NESTING, PolicyEngine, PolicyError,
};

/// A tokio worker's default stack.
const WORKER_STACK: usize = 2 << 20;

/// Loads `text` as the routine policy and decides one call, on a thread with a tokio
/// worker's stack: a stack overflow aborts the test binary.
fn load_and_decide(text: String) -> Result<Verdict, PolicyError> {
    std::thread::Builder::new()
        .stack_size(WORKER_STACK)
        .spawn(move || {
            let engine = PolicyEngine::builder().routine_policy(text).build()?;
            let request =
                DecisionRequest::builder("triage", "run_1", "mail", "send", ToolClass::ReadOnly)
                    .build();
            Ok(engine.decide(&request).outcome)
        })
        .unwrap()
        .join()
        .unwrap()
}

fn permit_when(condition: &str) -> String {
    format!(
        "@id(\"deep\")\n@decision(\"deny\")\npermit (principal, action, resource)\nwhen {{ {condition} }};"
    )
}

/// Conditions that are true and nest `levels` deep (the `when { }` is one level).
fn nested_condition(kind: &str, levels: usize) -> String {
    let inner = levels - 1;
    match kind {
        "paren" => format!("{}true{}", "(".repeat(inner), ")".repeat(inner)),
        "record" => format!(
            "{}true{}{}",
            "{a: ".repeat(inner),
            "}".repeat(inner),
            ".a".repeat(inner)
        ),
        "if" => format!(
            "{}true",
            "if context.untrusted_in_context then false else ".repeat(inner)
        ),
        other => panic!("{other}"),
    }
}

#[test]
fn policies_at_the_limit_load_and_decide_on_a_worker_stack() {
    for kind in ["paren", "record", "if"] {
        let text = permit_when(&nested_condition(kind, MAX_POLICY_NESTING));
        assert_eq!(load_and_decide(text), Ok(Verdict::Deny), "{kind}");
    }
    // Sets: `[[…[true]…]]` nests, and `.contains` needs an element of the same type.
    let inner = MAX_POLICY_NESTING - 2;
    let set = format!("{}true{}", "[".repeat(inner), "]".repeat(inner));
    let text = permit_when(&format!("[{set}].contains({set})"));
    assert_eq!(load_and_decide(text), Ok(Verdict::Deny), "set");
    // The deepest nesting and the longest operator chain at once.
    let parens = MAX_POLICY_NESTING - 1;
    let deepest = |links: usize| {
        let chain = "context.budget_used.turns".to_owned() + &" + 1".repeat(links) + " > 0";
        permit_when(&format!(
            "{}{chain}{}",
            "(".repeat(parens),
            ")".repeat(parens)
        ))
    };
    let too_deep = |links| {
        matches!(
            load_and_decide(deepest(links)),
            Err(PolicyError::ExpressionTooDeep { .. })
        )
    };
    // The longest chain allowed inside the parentheses: the measure is an upper bound, close
    // to the real depth.
    let (mut allowed, mut refused) = (0, MAX_EXPRESSION_DEPTH);
    assert!(!too_deep(allowed) && too_deep(refused));
    while refused - allowed > 1 {
        let middle = usize::midpoint(allowed, refused);
        if too_deep(middle) {
            refused = middle;
        } else {
            allowed = middle;
        }
    }
    assert!(
        allowed > MAX_EXPRESSION_DEPTH - 3 * MAX_POLICY_NESTING,
        "{allowed}"
    );
    assert_eq!(
        load_and_decide(deepest(allowed)),
        Ok(Verdict::Deny),
        "paren and chain"
    );
}

#[test]
fn one_level_more_is_refused_naming_the_limit_and_the_line() {
    for kind in ["paren", "record", "if"] {
        let text = permit_when(&nested_condition(kind, MAX_POLICY_NESTING + 1));
        let err = load_and_decide(text).unwrap_err();
        assert!(
            matches!(
                err,
                PolicyError::TooDeep {
                    limit: MAX_POLICY_NESTING,
                    ..
                }
            ),
            "{kind}: {err}"
        );
        assert_eq!(
            err.location().and_then(|at| at.line()),
            Some(4),
            "{kind}: {err}"
        );
        let message = err.to_string();
        assert!(
            message.contains(&format!("deeper than {MAX_POLICY_NESTING} levels"))
                && message.starts_with("routine policy, line 4, column "),
            "{message}"
        );
    }
    // What overflowed the server before: 144 parentheses, 200 brackets or records.
    for condition in [
        format!("{}true{}", "(".repeat(144), ")".repeat(144)),
        format!("{}true{}.isEmpty()", "[".repeat(200), "]".repeat(200)),
        format!("{}1{} has a", "{a: ".repeat(200), "}".repeat(200)),
        format!("{}true", "if true then false else ".repeat(2000)),
    ] {
        let err = load_and_decide(permit_when(&condition)).unwrap_err();
        assert!(matches!(err, PolicyError::TooDeep { .. }), "{err}");
    }
}

#[test]
fn long_operator_chains_are_refused_before_cedar_sees_them() {
    // Each of these overflowed a 2 MiB stack somewhere in Cedar at about 8,000 links.
    for link in [" + 1", ".turns", "[\"turns\"]", ".contains(1)"] {
        let condition = "context.budget_used".to_owned() + &link.repeat(20_000);
        let err = load_and_decide(permit_when(&condition)).unwrap_err();
        assert!(
            matches!(
                err,
                PolicyError::ExpressionTooDeep {
                    limit: MAX_EXPRESSION_DEPTH,
                    ..
                }
            ),
            "{link}: {err}"
        );
        assert!(
            err.to_string()
                .contains(&format!("deeper than {MAX_EXPRESSION_DEPTH} operators")),
            "{err}"
        );
    }
}

#[test]
fn brackets_in_strings_and_comments_do_not_count() {
    let deep = "(".repeat(500);
    let text = format!(
        "// {deep}\n@id(\"{deep}\")\n@decision(\"deny\")\n\
         permit (principal, action, resource) when {{ context.arguments_json != \"\\\"{deep}\" }};"
    );
    assert_eq!(load_and_decide(text), Ok(Verdict::Deny));
}

/// One way to wrap a true boolean expression in another.
#[derive(Debug, Clone, Copy)]
enum Wrapper {
    Paren,
    Set,
    Record,
    If,
    Comment,
    And,
}

impl Wrapper {
    /// The expression wrapped, and the nesting (brackets and `if`) it adds.
    fn wrap(self, inner: &str) -> (String, usize) {
        match self {
            Wrapper::Paren => (format!("({inner})"), 1),
            Wrapper::Set => (format!("[{inner}].contains(true)"), 1),
            Wrapper::Record => (format!("{{a: {inner}, b: \"}}])\"}}.a"), 1),
            Wrapper::If => (format!("(if {inner} then true else true)"), 2),
            Wrapper::Comment => (format!("{inner} // ((([[{{\n"), 0),
            Wrapper::And => (format!("context.budget_used.turns + 1 > 0 && ({inner})"), 1),
        }
    }
}

/// A true, schema-valid boolean expression and its nesting, from 0 to about 80 levels.
fn expression() -> impl Strategy<Value = (String, usize)> {
    let leaf = prop_oneof![
        Just("true"),
        Just("!context.untrusted_in_context"),
        Just("\"([{\" like \"([{*\""),
    ];
    let wrapper = prop_oneof![
        Just(Wrapper::Paren),
        Just(Wrapper::Set),
        Just(Wrapper::Record),
        Just(Wrapper::If),
        Just(Wrapper::Comment),
        Just(Wrapper::And),
    ];
    (leaf, proptest::collection::vec(wrapper, 0..48)).prop_map(|(leaf, wrappers)| {
        wrappers
            .into_iter()
            .fold((leaf.to_owned(), 0), |(inner, depth), wrapper| {
                let (outer, added) = wrapper.wrap(&inner);
                (outer, depth + added)
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random nesting never overflows: within the limit the policy loads and matches, beyond
    /// it the policy is refused with the depth error.
    #[test]
    fn random_nesting_loads_or_is_refused_with_the_depth_error((condition, depth) in expression()) {
        let levels = depth + 1; // the `when { }`
        let result = load_and_decide(permit_when(&condition));
        if levels <= MAX_POLICY_NESTING {
            prop_assert_eq!(result, Ok(Verdict::Deny), "{} levels: {}", levels, condition);
        } else {
            prop_assert!(
                matches!(result, Err(PolicyError::TooDeep { .. })),
                "{} levels: {:?}", levels, result
            );
        }
    }
}
