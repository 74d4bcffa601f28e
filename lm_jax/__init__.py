"""lm_jax: pre-train, evaluate and export BERT-, GPT-1-, GPT-2- and T5-style language models in pure JAX.

Data flows config -> batch -> step -> checkpoint (docs/architecture.md: who owns which fact, import direction):
  main.py         the CLI (--mode=train|eval|export|predict|generate|summary|compile|...)
  config_lib.py   loads configs and overrides (imports nothing of the library); checks.py checks them against the
                  devices, asking each owner
  layout.py       the one I/O-free layout: config + mesh -> optimizer, abstract train state, shardings
  train.py        the trainer: setup, init or restore, its jitted steps on loop.py's shared schedules
  loop.py         the schedules every trainer shares: log, eval, checkpoint, preemption, resume, throughput
  rlhf/           PPO: a trainer of its own (rollout, scoring, update) on loop.py's schedules
  init_from.py    where a run starts (a Hugging Face directory or another run) and where eval / export take params
  step.py         the train state and the one jitted, mesh-sharded train / eval step for every objective
  params.py       the run's params policy: what its params are and what trains (freezing, adapters, layer decay)
  peft/           adapter methods behind params.py (LoRA / QLoRA, IA³) and the PEFT format
  objectives/     one file per objective (mlm, clm, span_corruption, classify, gpt_classify, text_to_text, sft,
                  reward, dpo, ppo): rows, transform, loss, lengths, checks
  data/           one record reader (records.py: TFDS, .txt / .jsonl / .tsv, bad records named by file:line) under
                  text, task, instruction and preference data; tokenizers, row layouts, the host-count-independent
                  pipeline
  models/         one file per family (bert.py, gpt.py, gpt2.py, t5.py; linen, applied functionally) on shared
                  layers, each declaring its Family record (registry.py): layout, FLOPs, tokenizer specials, decoding
  hf/             Hugging Face conversion per family and export / import of checkpoint directories
  decoding.py     greedy / sampling / beam search on the KV cache, and scoring; it asks the family, never names it
  sharding.py     the mesh and logical-axis rules; checkpoint.py orbax save / restore / resume, best checkpoint
  optim.py        the papers' optimizers and schedules; flops.py FLOP counts; summary.py param tables
  evals/          held-out metrics, --mode=predict, probes, zero-shot, lm-eval, generate / fill-mask
  plan/           --mode=compile for a topology, --plan, memory estimates, peak FLOP/s
  obs/            time split (goodput), profiles, metrics.jsonl / TensorBoard / W&B, plots
  distributed.py  multi-host initialisation (local processes, SLURM, TPU VMs); malloc.py host allocator setup
  scaling/        Kaplan / Chinchilla laws: predict, fit, allocate, sweep, plot
"""
