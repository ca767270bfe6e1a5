//! Budget arithmetic: what a run has used, and whether the next step fits its limits.
//!
//! Exhausting a budget is a value ([`BudgetExceeded`]), not an error: the engine ends the run as
//! `budget_exceeded`, naming the limit. A nested routine draws on its root run's usage.

use std::fmt;

use crate::routine::BudgetLimits;

/// What a run (or a root run with its nested runs) has used so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BudgetUsage {
    pub turns: u64,
    pub tool_calls: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cost_microdollars: u64,
}

/// Which limit a run hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetLimit {
    Turns,
    ToolCalls,
    InputTokens,
    OutputTokens,
    Cost,
    WallTime,
}

impl BudgetLimit {
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetLimit::Turns => "turns",
            BudgetLimit::ToolCalls => "tool_calls",
            BudgetLimit::InputTokens => "input_tokens",
            BudgetLimit::OutputTokens => "output_tokens",
            BudgetLimit::Cost => "cost_microdollars",
            BudgetLimit::WallTime => "wall_seconds",
        }
    }
}

/// A limit that was reached, with the figures that show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BudgetExceeded {
    pub limit: BudgetLimit,
    pub used: u64,
    pub allowed: u64,
}

impl fmt::Display for BudgetExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let limit = self.limit.as_str();
        match self.limit {
            // Turns and tool calls are reserved one at a time, and a reservation past the limit
            // is refused: `used` counts the one refused, which the run's usage never shows.
            // A nested run given nothing of its parent's budget.
            BudgetLimit::Turns | BudgetLimit::ToolCalls if self.allowed == 0 => write!(
                f,
                "budget `{limit}` exhausted: none was left for this run, and it needed one"
            ),
            BudgetLimit::Turns | BudgetLimit::ToolCalls => write!(
                f,
                "budget `{limit}` exhausted: all {} allowed are used, and the run needed one more",
                self.allowed
            ),
            _ => write!(
                f,
                "budget `{limit}` exhausted: {} used of {} allowed",
                self.used, self.allowed
            ),
        }
    }
}

/// A model's price in millionths of a dollar per million tokens, so that integer arithmetic
/// is exact for any realistic price.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelPrice {
    pub input_microdollars_per_mtok: u64,
    pub output_microdollars_per_mtok: u64,
}

impl ModelPrice {
    /// The cost of one model call, rounded up to a whole microdollar.
    pub fn cost(&self, input_tokens: u64, output_tokens: u64) -> u64 {
        let input = u128::from(input_tokens) * u128::from(self.input_microdollars_per_mtok);
        let output = u128::from(output_tokens) * u128::from(self.output_microdollars_per_mtok);
        let total = input.saturating_add(output);
        u64::try_from(total.div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }
}

fn over(limit: BudgetLimit, used: u64, allowed: u64) -> Result<(), BudgetExceeded> {
    if used > allowed {
        Err(BudgetExceeded {
            limit,
            used,
            allowed,
        })
    } else {
        Ok(())
    }
}

impl BudgetUsage {
    /// Whether everything used so far is within the limits, and `elapsed_seconds` within the
    /// wall time. The first limit found exceeded is returned.
    pub fn check(&self, limits: &BudgetLimits, elapsed_seconds: u64) -> Result<(), BudgetExceeded> {
        over(BudgetLimit::Turns, self.turns, limits.turns)?;
        over(BudgetLimit::ToolCalls, self.tool_calls, limits.tool_calls)?;
        over(
            BudgetLimit::InputTokens,
            self.input_tokens,
            limits.input_tokens,
        )?;
        over(
            BudgetLimit::OutputTokens,
            self.output_tokens,
            limits.output_tokens,
        )?;
        over(
            BudgetLimit::Cost,
            self.cost_microdollars,
            limits.cost_microdollars,
        )?;
        if elapsed_seconds >= limits.wall_seconds {
            return Err(BudgetExceeded {
                limit: BudgetLimit::WallTime,
                used: elapsed_seconds,
                allowed: limits.wall_seconds,
            });
        }
        Ok(())
    }

    /// Reserves one more model turn, refusing it when no turn is left.
    pub fn reserve_turn(&self, limits: &BudgetLimits) -> Result<BudgetUsage, BudgetExceeded> {
        let next = BudgetUsage {
            turns: self.turns.saturating_add(1),
            ..*self
        };
        over(BudgetLimit::Turns, next.turns, limits.turns)?;
        Ok(next)
    }

    /// Reserves one more tool call, refusing it when none is left.
    pub fn reserve_tool_call(&self, limits: &BudgetLimits) -> Result<BudgetUsage, BudgetExceeded> {
        let next = BudgetUsage {
            tool_calls: self.tool_calls.saturating_add(1),
            ..*self
        };
        over(BudgetLimit::ToolCalls, next.tool_calls, limits.tool_calls)?;
        Ok(next)
    }

    /// Adds a model call's tokens and cost.
    pub fn add_model_usage(
        &self,
        input_tokens: u64,
        output_tokens: u64,
        price: &ModelPrice,
    ) -> BudgetUsage {
        BudgetUsage {
            input_tokens: self.input_tokens.saturating_add(input_tokens),
            output_tokens: self.output_tokens.saturating_add(output_tokens),
            cost_microdollars: self
                .cost_microdollars
                .saturating_add(price.cost(input_tokens, output_tokens)),
            ..*self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> BudgetLimits {
        BudgetLimits {
            turns: 2,
            tool_calls: 1,
            input_tokens: 100,
            output_tokens: 50,
            cost_microdollars: 1_000,
            wall_seconds: 60,
        }
    }

    #[test]
    fn reservations_stop_at_the_limit() {
        let l = limits();
        let u = BudgetUsage::default()
            .reserve_turn(&l)
            .unwrap()
            .reserve_turn(&l)
            .unwrap();
        let e = u.reserve_turn(&l).unwrap_err();
        assert_eq!((e.limit, e.used, e.allowed), (BudgetLimit::Turns, 3, 2));
        let u = u.reserve_tool_call(&l).unwrap();
        assert_eq!(
            u.reserve_tool_call(&l).unwrap_err().limit,
            BudgetLimit::ToolCalls
        );
        assert_eq!(
            e.to_string(),
            "budget `turns` exhausted: all 2 allowed are used, and the run needed one more"
        );
        let none_left = BudgetExceeded {
            limit: BudgetLimit::Turns,
            used: 1,
            allowed: 0,
        };
        assert_eq!(
            none_left.to_string(),
            "budget `turns` exhausted: none was left for this run, and it needed one"
        );
        let tokens = BudgetExceeded {
            limit: BudgetLimit::InputTokens,
            used: 1200,
            allowed: 1000,
        };
        assert_eq!(
            tokens.to_string(),
            "budget `input_tokens` exhausted: 1200 used of 1000 allowed"
        );
    }

    #[test]
    fn each_limit_is_named_when_exceeded() {
        let l = limits();
        let price = ModelPrice {
            input_microdollars_per_mtok: 3_000_000,
            output_microdollars_per_mtok: 15_000_000,
        };
        let within = BudgetUsage::default().add_model_usage(100, 50, &price);
        assert_eq!(within.cost_microdollars, 300 + 750);
        assert_eq!(within.check(&l, 0).unwrap_err().limit, BudgetLimit::Cost);
        let cheap = ModelPrice::default();
        assert!(
            BudgetUsage::default()
                .add_model_usage(100, 50, &cheap)
                .check(&l, 59)
                .is_ok()
        );
        assert_eq!(
            BudgetUsage::default()
                .add_model_usage(101, 0, &cheap)
                .check(&l, 0)
                .unwrap_err()
                .limit,
            BudgetLimit::InputTokens
        );
        assert_eq!(
            BudgetUsage::default()
                .add_model_usage(0, 51, &cheap)
                .check(&l, 0)
                .unwrap_err()
                .limit,
            BudgetLimit::OutputTokens
        );
        assert_eq!(
            BudgetUsage::default().check(&l, 60).unwrap_err().limit,
            BudgetLimit::WallTime
        );
    }

    #[test]
    fn cost_rounds_up_and_never_overflows() {
        let price = ModelPrice {
            input_microdollars_per_mtok: 1,
            output_microdollars_per_mtok: 0,
        };
        assert_eq!(
            price.cost(1, 0),
            1,
            "a fraction of a microdollar is charged as one"
        );
        assert_eq!(price.cost(0, 0), 0);
        let huge = ModelPrice {
            input_microdollars_per_mtok: u64::MAX,
            output_microdollars_per_mtok: u64::MAX,
        };
        assert_eq!(huge.cost(u64::MAX, u64::MAX), u64::MAX);
    }
}
