"""Data: one record reader (records.py: TFDS, local files; bad records counted and named by file:line) under
pre-training text (sources; several mixed by weight: mixture), task examples (tasks), instructions / preferences /
PPO prompts (instructions); tokenizers, and the input pipeline that feeds each objective.

tokenizer.load_or_train(config, workdir) -> Tokenizer
pipeline.make_train_iterator / make_eval_iterator(config, tokenizer, objective, process_index=, process_count=)
rows.Stream / rows.PerDocument: the two row layouts an objective chooses from
"""
