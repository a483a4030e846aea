"""modelship.engine"""
