"""Reward shaping on finished trajectories (the outcome reward belongs to each environment).

Import from the modules themselves; the package imports nothing, so importing one part
does not load the others.
"""
