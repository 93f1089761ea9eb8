"""`python -m arr_coc eval ...` with fixed-shape buckets, eagerly (the fill's effect without any compile):
the CLI's own eval, its wrapper switched to Execution(buckets=Buckets()) right after loading."""
import sys
import arr_coc.evaluation.loop as loop
from arr_coc.buckets import Buckets
from arr_coc.execution import Execution
original = loop.load_wrapper
def load_with_buckets(*a, **k):
    return original(*a, **k).use(Execution(buckets=Buckets(), label="buckets (eager)"))
loop.load_wrapper = load_with_buckets
from arr_coc.cli import main
sys.exit(main(["eval"] + sys.argv[1:]))
