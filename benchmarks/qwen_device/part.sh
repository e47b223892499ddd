mkdir -p ~/stage && mv .stage/g* ~/stage/ && ls ~/stage | tr '\n' ' ' && du -sh ~/stage
