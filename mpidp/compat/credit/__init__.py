"""NCAR CREDIT's domain parallelism on mpidp: ``credit.domain_parallel`` is
:mod:`mpidp.compat.credit.domain_parallel`, ``credit.parallel`` is
:mod:`mpidp.compat.credit.parallel`; both are re-exported here."""

from mpidp.compat.credit import domain_parallel, parallel
from mpidp.compat.credit.domain_parallel import *  # noqa: F403
from mpidp.compat.credit.domain_parallel import __all__ as _dp_all
from mpidp.compat.credit.parallel import *  # noqa: F403
from mpidp.compat.credit.parallel import __all__ as _parallel_all

__all__ = ["domain_parallel", "parallel", *_dp_all, *_parallel_all]
