"""What `export` writes for serving: the merged Hugging Face model (merged.py), adapters combined
into one (combined.py). The command itself is finetuning_pipeline/export.py."""
