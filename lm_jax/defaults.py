"""Fields every experiment config has, with their defaults; configs/*.py override them."""
import ast
import functools
import pathlib

import ml_collections

_MODELS = pathlib.Path(__file__).resolve().parent / "models"


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.objective = ""
  c.init_from = ""                # a Hugging Face directory or another run's workdir to start from
  c.model = ml_collections.ConfigDict()

  c.data = ml_collections.ConfigDict()
  c.data.tfds_name = ""           # e.g. "tiny_shakespeare", "c4/en:3.1.0"
  c.data.tfds_data_dir = ""       # "" = TFDS default (~/tensorflow_datasets or $TFDS_DATA_DIR)
  c.data.files = ""               # glob: .txt .jsonl .tsv .jsonl.gz .jsonl.zst .parquet, datasets folders
  c.data.train_split = "train"
  c.data.eval_split = "validation"
  c.data.text_field = "text"
  c.data.tokenizer = ""           # path to a tokenizer; "" = train SentencePiece on the data, cache in workdir
  c.data.tokenizer_type = "unigram"  # unigram or bpe (SentencePiece trained here), or char: one id per character
  c.data.seq_len = 128
  c.data.target_len = 0           # T5 targets; 0 = derived from seq_len by T5's random_spans_helper rule
  c.data.mlm_probability = 0.15
  c.data.max_predictions_per_seq = 20
  c.data.whole_word_mask = False
  c.data.nsp = False
  c.data.noise_density = 0.15
  c.data.mean_noise_span_length = 3.0
  c.data.shuffle = True
  c.data.shards = 1               # training stream shards; hosts split them (see lm_jax/data/pipeline.py)
  c.data.split_fraction = 0.0     # > 0: train on this first fraction of data.files' text, eval on the rest
                                  # (nanoGPT's split of one file); 0 = the files' own train_split / eval_split,
                                  # or 0.9 of the documents when data.files has no {split} (lm_jax/data/sources.py)
  c.data.windows = False          # train on random seq_len windows of the split's text (nanoGPT's get_batch) and
                                  # eval on all of it in consecutive windows (lm_jax/data/windows.py)
  c.data.eval_batches = 8         # batches per eval; 0 = every complete batch of the eval split
  c.data.prepared = ""            # tokenized shards (python -m lm_jax.prepare) read instead of files
  c.data.workers = 1              # processes tokenizing on the fly (the same batches for any number)
  c.data.mixture = ()             # sources sampled by weight into one stream (replaces tfds_name):
                                  # (dict(name=, files= or tfds_name=, text_field=, train_split=, eval_split=,
                                  # weight=), ...); left-out fields are data.*'s (lm_jax/data/mixture.py)

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "adamw"
  c.optimizer.lr = 1e-4
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  c.optimizer.eps = 1e-8
  c.optimizer.weight_decay = 0.0
  c.optimizer.warmup_steps = 0
  c.optimizer.schedule = "linear"
  c.optimizer.min_lr_ratio = 0.0  # linear / cosine decay end at lr * min_lr_ratio (nanoGPT's min_lr / lr)
  c.optimizer.clip_norm = 1.0
  c.optimizer.cooldown_fraction = 0.2  # wsd: the last 20% of total_steps decays to lr * min_lr_ratio
  c.optimizer.cooldown_shape = "linear"  # wsd: linear | 1-sqrt | cosine
  c.optimizer.cooldown_start = 0  # wsd: step the cooldown starts (0 = from cooldown_fraction); with init_from a
                                  # stable-phase workdir, a branched cooldown from its checkpoint (docs/configs.md)
  c.optimizer.adam_lr = 0.0       # muon: AdamW's lr for embeddings, output head, norms, biases (0 = optimizer.lr)
  c.optimizer.muon_momentum = 0.95  # muon: Nesterov momentum of the matrices

  c.z_loss = 0.0                  # z-loss weight on log(Z)^2 (PaLM / T5X); 0 = off
  c.label_smoothing = 0.0

  c.batch_size = 8
  c.total_steps = 100             # length of the lr schedule
  c.phase_end_step = 0            # stop here (0 = total_steps); BERT phase 1 ends at 90% of the schedule
  c.microbatches = 1
  c.seed = 0
  c.log_every = 10
  c.eval_every = 0
  c.checkpoint_every = 1000
  c.keep_checkpoints = 2
  c.storage_retry_s = 600         # a checkpoint write retries unreachable storage this long, then the run stops
  c.peak_tflops = 0.0             # per device, for MFU; 0 = a table by device kind (lm_jax/plan/hardware.py)

  c.profile = ml_collections.ConfigDict()   # jax.profiler traces into WORKDIR/profile (lm_jax/obs/profiling.py)
  c.profile.steps = ()            # (first step, number of steps) to trace, e.g. (10, 3); () = off
  c.profile.host = False          # also trace the host's Python calls (input pipeline, loop): bigger traces
  c.profile.all_processes = False # every process writes a trace; False = process 0 only

  c.wandb = ml_collections.ConfigDict()     # Weights & Biases from process 0 (lm_jax/obs/wandb_log.py)
  c.wandb.project = ""            # "" = off
  c.wandb.entity = ""             # "" = your default entity
  c.wandb.name = ""               # "" = W&B's generated name
  c.wandb.tags = ()
  c.wandb.mode = ""               # online, offline or disabled; "" = WANDB_MODE or online

  c.eval = ml_collections.ConfigDict()   # lm-evaluation-harness tasks (lm_jax/evals/lm_eval_adapter.py)
  c.eval.lm_eval_tasks = ()       # the harness' task names or configs/lm_eval's, e.g. ("lm_jax_sst2",); () = off
  c.eval.lm_eval_every = 0        # steps between runs of the tasks, a multiple of eval_every; 0 = at every eval
  c.eval.lm_eval_limit = 0        # documents per task (the harness' --limit); 0 = all

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1                # -1 takes the devices the other axes leave
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.logical_axis_rules = ()       # ((logical_name, mesh_axes), ...); () = lm_jax.sharding.RULES

  c.task = ml_collections.ConfigDict()   # labelled examples for fine-tuning (lm_jax/data/tasks.py)
  c.task.files = ""               # glob of .tsv/.jsonl with {split}, e.g. /data/sst2/{split}.tsv; replaces TFDS
  c.task.tfds_name = ""           # e.g. "glue/sst2" (read like data.tfds_name, from data.tfds_data_dir)
  c.task.text_fields = ("sentence",)  # one field, or two for sentence pairs; in a headerless .tsv column numbers
  c.task.label_field = "label"
  c.task.label_names = ()         # labels as written in the data, in class order; () = class numbers
  c.task.test_split = "test"      # --mode=predict writes predictions for it (train / eval: data.*_split)
  c.task.choice_fields = ()       # multiple choice: the K answer fields (text_fields: the one context field)
  c.task.format = "classify"      # gpt_classify's GPT-1 input transformation: classify, entailment, similarity,
                                  # multiple_choice
  c.task.lm_coef = 0.5            # gpt_classify: weight of the auxiliary LM loss (GPT-1 §3.2 lambda)
  c.task.prefix = ""              # text_to_text: the task prefix of every input, e.g. "sst2" -> "sst2 sentence: ..."
  c.task.field_names = ()         # text_to_text: the name written before each text; () = text_fields

  c.finetune = ml_collections.ConfigDict()   # starting from init_from (init_from.py), what trains (params.py)
  c.finetune.freeze = ()          # regexes over parameter paths, e.g. ("embeddings", "layers_[0-9]/")
  c.finetune.reinit_top_layers = 0  # the top layers keep their fresh init instead of the pre-trained values
  c.finetune.layer_decay = 1.0    # lr of layer i = lr * decay^(num_layers - i), embeddings one step lower; 1 = off
  c.finetune.best_metric = ""     # e.g. "eval_accuracy": keep the checkpoint of the best eval in WORKDIR/best

  c.rlhf = ml_collections.ConfigDict()   # instruction / preference data and losses (lm_jax/data/instructions.py)
  c.rlhf.files = ""               # glob of .jsonl with {split}: {prompt, response} (sft), {prompt, chosen, rejected}
  c.rlhf.prompt_field = "prompt"
  c.rlhf.response_field = "response"
  c.rlhf.chosen_field = "chosen"
  c.rlhf.rejected_field = "rejected"
  c.rlhf.template = ""            # chat template with {prompt}, e.g. "Human: {prompt}\n\nAssistant:"; "" = as is
  c.rlhf.margin = 0.0             # reward model: loss -log sigmoid(r_chosen - r_rejected - margin)
  c.rlhf.dpo_beta = 0.1           # DPO's beta (Rafailov et al. 2023)

  c.lora = ml_collections.ConfigDict()   # LoRA adapters (lm_jax/peft/lora.py, docs/lora.md)
  c.lora.rank = 0                 # r; 0 = off
  c.lora.alpha = 16.0             # scale alpha / r (alpha / sqrt(r) with rslora)
  c.lora.dropout = 0.0            # PEFT's lora_dropout: drops the adapters' input while training
  c.lora.targets = ("attention/(query|value)/",)   # regexes over Dense kernel paths, e.g. "kernel" = all of them
  c.lora.rslora = False
  c.lora.modules_to_save = ("^classifier/",)       # params that train fully beside the adapters (the task head)
  c.lora.init_from = ""           # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
  c.lora.qlora = False            # frozen Dense kernels stored as NF4 (double quantisation), adapters float32

  c.ia3 = ml_collections.ConfigDict()    # IA³ scaling vectors (lm_jax/peft/ia3.py, docs/lora.md); one method at a time
  c.ia3.targets = ()              # regexes over Dense kernel paths; non-empty = on, e.g. ("attention/(key|value)/",)
  c.ia3.feedforward = ()          # those of the targets whose input is scaled (PEFT's feedforward_modules), not output
  c.ia3.modules_to_save = ("^classifier/",)       # params that train fully beside the vectors (the task head)
  c.ia3.init_from = ""            # a PEFT IA3 adapter directory
  return c


def model_defaults(family: str) -> ml_collections.ConfigDict:
  """The shared model config fields (those every family has) and the family's own (family_fields); the family's
  config fills in the sizes."""
  m = ml_collections.ConfigDict()
  m.family = family
  m.vocab_size = 0
  m.d_model = 0
  m.num_layers = 0
  m.num_heads = 0
  m.head_dim = 0                  # 0 = d_model // num_heads
  m.d_ff = 0
  m.activation = "gelu_tanh"
  m.gated_ffn = False
  m.layer_norm_eps = 1e-12
  m.dropout_rate = 0.1
  m.attention_dropout_rate = 0.1
  m.initializer_range = 0.02
  m.dtype = "float32"
  m.param_dtype = "float32"
  m.scan_layers = False
  m.remat_policy = "none"
  m.attention = "xla"             # kernel: xla, cudnn (jax.nn.dot_product_attention, cuDNN on GPU), splash (TPU)
  m.pad_token_id = 0
  m.eos_token_id = 1
  m.frozen_reference = False      # params get a 'reference' copy, frozen (DPO's reference model, objectives/dpo.py)
  m.update(family_fields(family))
  return m


def family_fields(family: str) -> dict:
  """The family's own model config fields and their defaults: the `FIELDS` dict literal of
  lm_jax/models/<family>.py (its Family record's `fields`), read from the source so that loading a config imports
  no jax."""
  path = _MODELS / f"{family}.py"
  if not (isinstance(family, str) and family.isidentifier() and path.is_file()):
    raise ValueError(f"unknown model.family {family!r}: no lm_jax/models/<family>.py declares it")
  return dict(_fields(path))


@functools.lru_cache(maxsize=None)
def _fields(path: pathlib.Path) -> dict:
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["FIELDS"]:
      return ast.literal_eval(node.value)
  raise ValueError(f"{path.name} declares no FIELDS dict of its model config fields")


def gpt1_model() -> ml_collections.ConfigDict:
  """GPT-1's architecture (Radford et al. 2018, openai/finetune-transformer-lm): 12 layers of 768, 12 heads, d_ff
  3072, BPE vocabulary 40478, context 512, LayerNorm eps 1e-5. Pre-training uses it; fine-tuning and RLHF configs
  start from it (their init_from's architecture replaces it)."""
  m = model_defaults("gpt")
  m.num_layers, m.d_model, m.num_heads, m.d_ff = 12, 768, 12, 3072
  m.vocab_size, m.max_positions, m.layer_norm_eps = 40478, 512, 1e-5
  return m


def tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Makes `c` the `tiny` variant every configs/*.py offers: a 2-layer, d_model-128 model without dropout on
  Tiny Shakespeare at seq 128, batch 32, 200 steps, so a whole run fits on a CPU. The config sets what is
  specific to its model and objective on top (positions, learning rate, head_dim, phases)."""
  m = c.model
  m.num_layers, m.d_model, m.num_heads, m.d_ff = 2, 128, 4, 512
  m.vocab_size = 2048
  m.dropout_rate = m.attention_dropout_rate = 0.0
  c.data.tfds_name = "tiny_shakespeare"
  c.data.train_split, c.data.eval_split = "train", "validation"
  c.data.seq_len = 128
  c.optimizer.warmup_steps = 20
  c.batch_size = 32
  c.total_steps = 200
  c.log_every, c.eval_every, c.checkpoint_every = 20, 100, 100
  return c
