"""Agents that train on TextRLHF-v0 (installed as ``textgym.agents``)."""
