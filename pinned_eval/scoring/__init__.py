"""Pure-Python scoring: rewards, unbiased pass@k, and miles-named eval metrics.

Nothing here imports Prefect or talks HTTP; Prefect tasks wrap these functions.
"""
