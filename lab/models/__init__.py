"""Model families: one file each, real architecture + loader ("random" | HF id | local path)."""
