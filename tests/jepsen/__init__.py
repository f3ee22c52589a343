"""Jepsen-style fault testing: a total-queue checker and a nemesis that kills, pauses and partitions nodes."""
