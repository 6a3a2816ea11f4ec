"""The pool's rollouts on Ray actors."""
