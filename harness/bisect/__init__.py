"""Bisect: name the upstream commit that broke us.

* :mod:`.bisect`: ``posttrain-harness bisect``, a binary search over an upstream
  checkout's first-parent history, each step a matrix cell in that commit's environment.
* :mod:`.git_history`: the checkout's history (commits between two refs, what one touched).
* :mod:`.suggestions`: the bisects a matrix report suggests.

Imports :mod:`harness.report` and :mod:`harness.matrix`.
"""
