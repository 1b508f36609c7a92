"""Recall's date formats, over Django's English ones (FORMAT_MODULE_PATH)."""
