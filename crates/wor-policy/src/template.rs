//! Project policy templates: whole project policies an operator opts into by name, filled with
//! the operator's choices.

/// The `trusted-arguments` template (docs/policies.md): the default policy, plus calls of the
/// listed consequential tools run after untrusted content when every argument is trusted-derived.
pub const TRUSTED_ARGUMENTS_TEMPLATE: &str =
    include_str!("../policies/templates/trusted_arguments.cedar");

/// The mark in [`TRUSTED_ARGUMENTS_TEMPLATE`] the tool list replaces.
const TOOL_LIST_MARK: &str = "/* TRUSTED_ARGUMENT_TOOLS */";

/// The templates by the name `wor policy set --template` takes.
pub const TEMPLATE_NAMES: [&str; 1] = ["trusted-arguments"];

/// Why a template could not be filled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("`{0}` is not a policy template; the templates are: trusted-arguments")]
    Unknown(String),
    #[error("the `trusted-arguments` template needs at least one tool (`--tool CONNECTION/TOOL`)")]
    NoTools,
    #[error("`{0}` is not a roster name CONNECTION/TOOL")]
    BadTool(String),
}

/// The project policy template `name` with `tools` as its list.
pub fn fill_template(name: &str, tools: &[String]) -> Result<String, TemplateError> {
    if name != "trusted-arguments" {
        return Err(TemplateError::Unknown(wor_core::quote::excerpt(name, 40)));
    }
    if tools.is_empty() {
        return Err(TemplateError::NoTools);
    }
    let mut list = Vec::with_capacity(tools.len());
    for tool in tools {
        let valid = tool.split_once('/').is_some_and(|(connection, name)| {
            !connection.is_empty()
                && !name.is_empty()
                && tool
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_-./".contains(c))
        });
        if !valid {
            return Err(TemplateError::BadTool(wor_core::quote::excerpt(tool, 80)));
        }
        list.push(format!("Tool::\"{tool}\""));
    }
    Ok(TRUSTED_ARGUMENTS_TEMPLATE.replace(TOOL_LIST_MARK, &list.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_is_filled_only_with_roster_names() {
        let filled = fill_template("trusted-arguments", &["bank/pay".to_owned()]).unwrap();
        assert!(!filled.contains(TOOL_LIST_MARK));
        assert_eq!(filled.matches("Tool::\"bank/pay\"").count(), 2);
        assert_eq!(
            fill_template("trusted-arguments", &["x\" || true".to_owned()]),
            Err(TemplateError::BadTool("x\" || true".to_owned()))
        );
        assert_eq!(
            fill_template("trusted-arguments", &[]),
            Err(TemplateError::NoTools)
        );
        assert!(matches!(
            fill_template("lenient", &["a/b".to_owned()]),
            Err(TemplateError::Unknown(_))
        ));
    }
}
