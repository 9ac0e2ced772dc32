"""Evaluation: scoring answers (:mod:`.scoring`), the runner's periodic evaluation
(:mod:`.periodic`) and evaluating a saved model (:mod:`.standalone`, ``reasonctl eval``)."""
