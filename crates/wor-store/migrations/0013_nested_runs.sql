-- A run started by another run's call to a routine tool: what is left of its root run's budget
-- when it started (JSON of budget limits); its own limits are capped by it.
ALTER TABLE runs ADD COLUMN budget_cap TEXT;
