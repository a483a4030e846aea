"""Releases: what is published, what takes traffic, and what a release is checked against.

Below both the pipeline (select publishes a release) and the fleet (which serves, canaries,
promotes and rolls back releases): the files a release holds and the plan of which ones
take traffic are defined here once, on top of `storage`'s layout and publish contract.
"""
