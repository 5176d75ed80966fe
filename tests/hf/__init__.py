"""Tests of Hugging Face transformers models traced exactly through qkv.hf."""
