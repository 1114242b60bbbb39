"""What is trained: datasets and partitions, models, one unit of local training, evaluation."""
