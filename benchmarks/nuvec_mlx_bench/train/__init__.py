"""``nuvec-mlx-bench-train``: mlx-lm models fine-tuned as mlx-lm trains them, with and without checkpoints.

:mod:`.cases` builds each strategy's model, optimizer and step; :mod:`.lengths`
finds the largest sequence that fits a memory and fits the peak against the
length; :mod:`.report` writes the tables and the plot; :mod:`.command` runs it.
"""
