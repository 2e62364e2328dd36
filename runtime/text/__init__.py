"""Text: the tokenizer, chat templates, stop ids and incremental detokenization."""
