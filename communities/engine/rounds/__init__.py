"""Signature rounds: how the ranks learn who is close to whom (a collective, or each rank's gossip table)."""
