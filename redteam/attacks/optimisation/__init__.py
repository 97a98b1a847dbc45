"""Optimisation attacks: gradient matching (DLG, iDLG, Inverting Gradients, GradInversion) and their engine."""
