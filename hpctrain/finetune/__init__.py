"""Fine-tuning: LoRA adapters on the model's projections (``lora``), and their export (``peft_export``)."""
