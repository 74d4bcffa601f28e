"""Parameter-efficient fine-tuning: LoRA adapters (lora.py) and NF4-quantised frozen weights for QLoRA (nf4.py)."""
