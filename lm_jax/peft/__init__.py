"""Parameter-efficient fine-tuning methods behind lm_jax.params: LoRA / QLoRA (lora.py) and IA³ (ia3.py), each a
transformation of the params tree registered in methods.py; the Dense kernels they target (targets.py) and the
Hugging Face PEFT adapter format (peft_format.py). NF4-quantised kernels live with the layers (models/nf4.py)."""
