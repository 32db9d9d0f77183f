"""specloop.samplers"""
