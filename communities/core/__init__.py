"""Pure math: signatures, clustering, partner laws, schedules, merge rules, protocol lists, robust statistics.

Functions of arrays, testable without MPI; nothing here imports from outside ``core``.
"""
