"""How replicas combine: the strategies (who and when), the mixers and the pairwise exchange (how)."""
