"""What a run is: the Brain, its command line, its files (records, checkpoint, summary, identity) and its environment."""
