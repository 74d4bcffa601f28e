"""Parameter-efficient fine-tuning: LoRA / QLoRA as a transformation of the params tree (lora.py), NF4-quantised
frozen weights for QLoRA (nf4.py) and the Hugging Face PEFT adapter format (peft_format.py)."""
