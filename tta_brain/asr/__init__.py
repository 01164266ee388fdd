"""CTC decoding, the word LM and the WER."""
