"""Data: one record reader (records.py: TFDS, local files in the formats corpora come in (formats.py), big or
compressed ones through a cached spill (spill.py); bad records counted and named by file:line) under pre-training
text (sources; several mixed by weight: mixture), task examples (tasks), instructions / preferences / PPO prompts
(instructions); tokenizers, and the input pipeline that feeds each objective, tokenizing on the fly (in worker
processes: workers.py) or reading shards tokenized once (prepare.py, prepared.py).

tokenizer.load_or_train(config, workdir, family) -> Tokenizer   (family: lm_jax.models.family(config.model), handed in)
pipeline.make_train_iterator / make_eval_iterator(config, tokenizer, objective, process_index=, process_count=)
rows.Stream / rows.PerDocument: the two row layouts an objective chooses from
"""
