"""The trainer. The commands sit here (main.py trains; evaluate, export, generate, preflight) and
import no other command; what they are built from lives in one folder per role: run_config/
(the settings), train/ (a phase: the loop and the step), run/ (a run's bookkeeping and its
replicas), model/ (the model's pieces), monitor/ (watching a run), planning/ (TPU time before
renting it), demo/ (the embedded demo)."""
