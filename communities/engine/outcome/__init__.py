"""What a run ends with: when the ranks have settled, one model or one per community, and what each rank delivers."""
