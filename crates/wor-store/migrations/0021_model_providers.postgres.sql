-- Model connections may speak Azure OpenAI and Gemini too; stored values keep their spelling.
ALTER TABLE model_connections DROP CONSTRAINT model_connections_provider_check;
ALTER TABLE model_connections ADD CONSTRAINT model_connections_provider_check
    CHECK (provider IN ('openai_compatible', 'anthropic', 'azure_openai', 'gemini'));
