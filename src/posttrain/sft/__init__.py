"""Supervised fine-tuning on Tunix's ``PeftTrainer``. The only package that imports Tunix."""
