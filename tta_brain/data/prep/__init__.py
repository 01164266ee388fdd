"""Corpus preparation: LibriSpeech, MS-SNSD, CHiME-3, the synthetic corpus."""
