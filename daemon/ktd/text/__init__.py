"""Text in, text out: the GGUF tokenizer, chat templates, tool calls, structured-output grammars
and token sampling with its stop logic."""
