"""Data: sources (TFDS, local files), tokenizers, and the input pipeline that feeds each objective.

tokenizer.load_or_train(config, workdir) -> Tokenizer
pipeline.make_train_iterator / make_eval_iterator(config, tokenizer, objective, process_index=, process_count=)
rows.Stream / rows.PerDocument: the two row layouts an objective chooses from
"""
